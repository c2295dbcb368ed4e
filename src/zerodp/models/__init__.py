"""The models zerodp's commands train: the GPT of the main job and its sizes (gpt.py, sizes.py), the
models built by name (build.py), Hugging Face model folders read and written (hf_folder.py), and
PEFT models built on meta, read from their base's folder (hf_peft.py), and weight files written a tensor at
a time (weight_files.py).
"""
