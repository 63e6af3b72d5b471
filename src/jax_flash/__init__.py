"""jax_flash: exact FlashAttention for JAX, as XLA FFI custom calls on CUDA GPUs and CPUs."""

from jax_flash import reference
from jax_flash.attention import attention, attention_varlen

__all__ = ["attention", "attention_varlen", "reference"]
__version__ = "0.1.0"
