"""What training reports: the steps_per_print line, wall_clock_breakdown timings, monitors
(TensorBoard, CSV, W&B) and the comms logger. The engine holds one StepMonitor (step.py)."""
