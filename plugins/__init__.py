"""Built-in storage backends of wds_cloud, one module per backend.

Each module is an ordinary plugin of the ``wds_cloud`` entry-point group,
declared in ``pyproject.toml`` exactly as a third-party plugin would be.
"""
