"""Streaming a choice's text as its tokens come: the engine hands over token ids; a client wants text, and never
text it will have to take back. So the text sent is held back where it could still change: a trailing partial
UTF-8 character (decoded as U+FFFD until its last byte comes), and anything that could be the start of a stop
string (the engine cuts the final text before a stop string). What is left when the choice is done is sent with
its last chunk, from the engine's final text."""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from streamrft.engines.inference.base import find_stop

logger = logging.getLogger(__name__)


class TextDeltas:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.stops = tuple(s for s in stops if s)
        self._held_back = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""

    def add(self, ids: list[int]) -> str:
        """The text that ``ids`` add and that is safe to send now."""
        self.ids += ids
        text = self.decode(self.ids)
        safe = len(text.rstrip("\ufffd"))
        found = find_stop(text, self.stops)
        safe = min(safe, found[0] if found is not None else len(text) - self._held_back)
        if safe <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):safe], text[:safe]
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the choice's text, given the engine's final text."""
        if not final_text.startswith(self.sent):
            logger.warning("serve: the final text of a streamed choice does not continue what was sent (%r, %r)",
                           self.sent[-40:], final_text[:80])
            return final_text[len(self.sent):] if len(final_text) > len(self.sent) else ""
        rest, self.sent = final_text[len(self.sent):], final_text
        return rest
