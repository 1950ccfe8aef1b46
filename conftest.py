"""Root conftest: the harness plugin itself is loaded through its pytest11 entry point
(`pip install -e .`, done by `make setup`); this file only adds what the harness's own tests use."""
pytest_plugins = ["pytester"]
