"""spillway: LLM serving as actors on NATS.

One namespace over the checkout's folders (pyproject.toml's package-dir): `spillway.shared`
is shared/, `spillway.services` is services/ and `spillway.kernels` is kernels/.
"""

__version__ = "0.1.0"
