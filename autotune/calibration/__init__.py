"""Calibration: micro-benchmarks of the real devices and links (``bench``), the plan and run of
``autotune profile`` (``profiler``), and online correction of the simulator from measured runs
(``online``)."""
