"""The benchmark (``python -m bench``, ``make bench``): measurement modules registered in :data:`bench.run.SECTIONS`;
bench/README.md lists them and says how to add one."""
