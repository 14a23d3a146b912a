"""Drafter checkpoints in other projects' layouts, read into hf_dspark drafters in memory (and written back out):
DeepSpec's, `vllm-project/speculators`' and z-lab DFlash's. One module per layout."""
