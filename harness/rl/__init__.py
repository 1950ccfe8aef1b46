"""The GRPO loop as a fixture and a command (`mrh loop`): harness.rl.loop, harness.rl.task."""
from harness.rl.loop import Iteration, LoopConfig, RLLoop, group_advantages
from harness.rl.task import ParityTask, make_task

__all__ = ["Iteration", "LoopConfig", "ParityTask", "RLLoop", "group_advantages", "make_task"]
