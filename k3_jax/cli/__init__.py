"""Command-line programs, installed as console scripts (``[project.scripts]`` in ``pyproject.toml``):

* ``k3-train`` — :func:`k3_jax.cli.train.main` (in a checkout: ``python train.py``)
* ``k3-serve`` — :func:`k3_jax.cli.serve.main` (in a checkout: ``python serve.py``)
* ``k3-convert`` — :func:`k3_jax.convert.__main__.main` (``python -m k3_jax.convert``)
"""
