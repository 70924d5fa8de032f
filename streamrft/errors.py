"""Errors that carry their own explanation: the CLI prints them without a traceback."""


class StreamrftError(Exception):
    """Base of errors whose message says what went wrong and how to fix it."""


# sysexits' EX_CONFIG: a role that exits with it stopped for a decision only a person can make; `streamrft run`
# does not restart it (a restart would meet the same state and stop again)
OPERATOR_EXIT = 78


class OperatorNeeded(StreamrftError):
    """The role stops because carrying on needs a person's decision (its consumer group was reset by someone
    else, ...); the message gives the ways on. Exit code :data:`OPERATOR_EXIT`."""


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
