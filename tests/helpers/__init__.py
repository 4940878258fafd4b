"""Plain helpers shared by the test modules (fixtures live in conftest.py files).

``tests/`` is on ``sys.path`` (``pythonpath`` in setup.cfg), so test modules import ``helpers.<module>``; the
subprocesses the tests start get it through ``PYTHONPATH`` (callbacks named by class path, ``helpers.kill...``).
"""
