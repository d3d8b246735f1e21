"""Development fixtures: the toy world, the tiny Qwen3 model kit and the scripted policies.

They stand in for BrowseComp-Plus, Qwen3-4B and the coordinator/worker LLMs on a machine with no
GPU and no network (DESIGN.md §6). They import only `core`.
"""
