"""The RL loop (`bcstack train rl`): rollouts through the live stack, judge grades, GRPO, export, reload."""
