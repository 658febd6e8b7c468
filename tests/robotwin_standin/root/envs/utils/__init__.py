from .create_actor import UnStableError

__all__ = ["UnStableError"]
