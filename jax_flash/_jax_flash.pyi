from typing import Any

has_cuda: bool
xla_ffi_api_version: tuple[int, int]
built_with_jax: str
built_with_jaxlib: str
cuda_gencode: str

def registrations() -> dict[str, tuple[Any, str]]: ...
def cpu_simd_level() -> str: ...
