"""One decode call (batch 1, 8k keys, bf16, 32 query / 8 KV heads, head_dim 128) of
jax_flash.attention and of cuDNN, three times each: a small target for a kernel profiler.

    XLA_FLAGS=--xla_gpu_autotune_level=0 ncu --csv --metrics gpu__time_duration.sum \\
        python3 tools/decode_one_call.py

The inputs are made on the host, so the profiled kernels are the two calls' own.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash


def main() -> None:
    rng = np.random.default_rng(0)
    q = jax.device_put(rng.standard_normal((1, 1, 32, 128)).astype(jnp.bfloat16))
    k = jax.device_put(rng.standard_normal((1, 8192, 8, 128)).astype(jnp.bfloat16))
    v = jax.device_put(rng.standard_normal((1, 8192, 8, 128)).astype(jnp.bfloat16))
    calls = {
        "attention": lambda q, k, v: jax_flash.attention(q, k, v, causal=True),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"),
    }
    for name, fn in calls.items():
        compiled = jax.jit(fn).lower(q, k, v).compile()
        for _ in range(3):
            jax.block_until_ready(compiled(q, k, v))
        print("ran", name, flush=True)


if __name__ == "__main__":
    main()
