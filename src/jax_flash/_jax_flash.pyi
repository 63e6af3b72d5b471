from typing import Any

has_cuda: bool

def registrations() -> dict[str, tuple[Any, str]]: ...
