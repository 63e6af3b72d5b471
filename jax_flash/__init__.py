"""jax_flash: exact FlashAttention for JAX, as XLA FFI custom calls on CUDA GPUs and CPUs."""

from jax_flash import reference
from jax_flash._autodiff import ForwardModeError
from jax_flash.attention import attention, attention_varlen
from jax_flash.capabilities import capabilities
from jax_flash.dot_product_attention import dot_product_attention
from jax_flash.export import disabled_export_checks
from jax_flash.kvcache import attention_with_kvcache
from jax_flash.ring import from_zigzag, ring_attention, to_zigzag

__all__ = [
    "ForwardModeError",
    "attention",
    "attention_with_kvcache",
    "attention_varlen",
    "capabilities",
    "disabled_export_checks",
    "dot_product_attention",
    "from_zigzag",
    "reference",
    "ring_attention",
    "to_zigzag",
]
__version__ = "0.1.0"
