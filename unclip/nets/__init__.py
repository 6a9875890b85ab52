"""The networks and their configs: the CLIP wrapper, the diffusion and autoregressive priors, the
decoder and upsamplers, the caption transformer, transformer blocks and LoRA layers.
"""
