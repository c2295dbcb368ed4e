"""`zerodp estimate`: a job's memory and communication, planned from one machine. estimate.py is the
command line (torch-free), tables.py its tables, models.py the models it plans for, peak.py the peak of
a step on fake tensors, measure.py one real step as rank 0 of N, communication.py the bytes per step by
collective and link."""
