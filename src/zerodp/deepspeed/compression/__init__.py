"""`deepspeed.compression`: only `helper`'s recursive_getattr / recursive_setattr, which LoRA scripts
(DeepSpeed-Chat's convert_linear_layer_to_lora) use to swap modules by dotted name. DeepSpeed's
compression training itself (init_compression, redundancy_clean) is not provided.

  helper.py  recursive_getattr / recursive_setattr.
"""
