"""What every role is built on: :class:`RoleRuntime` (its clients, metrics and the one role loop) and the
:class:`UnitOfWork` that loop commits. No role in here."""
from .role_runtime import Role, RoleRuntime
from .unit_of_work import UnitOfWork

__all__ = ["Role", "RoleRuntime", "UnitOfWork"]
