"""Side-by-side benchmarks of elaunch against torchrun (``python -m benchmarks.run``).

See docs/benchmarks.md for the method and the latest numbers.
"""
