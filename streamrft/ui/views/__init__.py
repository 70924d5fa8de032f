"""One module per page: each takes what it shows and returns the page's HTML."""
