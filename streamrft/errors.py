"""Errors that carry their own explanation: the CLI prints them without a traceback."""


class StreamrftError(Exception):
    """Base of errors whose message says what went wrong and how to fix it."""


class ConfigError(StreamrftError):
    """Invalid configuration, found at start-up."""


class BrokerError(StreamrftError):
    """The embedded broker could not be set up, started or reached."""


class AuthorizationError(StreamrftError):
    """Kafka refused this principal an operation on a resource (its ACLs do not allow it). The message names
    the principal, the operation, the resource and the ACL that would allow it."""


class AuthenticationError(StreamrftError):
    """Kafka refused the configured credentials (the message never contains the secret)."""


class RegistryError(StreamrftError):
    """The embedded schema registry could not be set up, started or reached."""


class SchemaIncompatibleError(StreamrftError):
    """The schema registry refused a record's schema: it breaks the subject's compatibility rule. The message
    names the record type, the subject and what to change."""
