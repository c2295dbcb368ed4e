"""What training reports: the steps_per_print line, wall_clock_breakdown timings, monitors
(TensorBoard, CSV, W&B) and the comms logger. The engine holds one StepMonitor (step.py).

  step.py     StepMonitor: the engine's view of each step for people.
  timers.py   wall_clock_breakdown's timings.
  writers.py  the monitors (TensorBoard, CSV, W&B) events go to.
  comms.py    comms_logger: calls, bytes and time of each collective.
"""
