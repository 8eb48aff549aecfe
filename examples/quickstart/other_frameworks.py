import jax
import jax.numpy as jnp
import numpy as np
from myops import scale

print(scale(np.ones(3, np.float32), 2.0))                    # NumPy: float32, the dtype it declares
print(jax.jit(scale, static_argnums=1)(jnp.ones(3), 2.0))    # under jax.jit (the float stays static)
print(jax.grad(lambda x: scale(x, 2.0).sum())(jnp.ones(3)))  # its declared backward
