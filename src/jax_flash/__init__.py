"""jax_flash: exact FlashAttention for JAX, as XLA FFI custom calls on CUDA GPUs and CPUs."""

from jax_flash import reference
from jax_flash.attention import attention

__all__ = ["attention", "reference"]
__version__ = "0.1.0"
