"""tandem: RL fine-tuning of LLMs with LoRA, inference and training as separate services.

This light package holds settings, schemas, Redis keys, the event stream, the adapter store
and the client SDK. It never imports torch. Development tools (the local stack, the `tandem`
command, the toy task) are in `tandem.dev`.
"""

from tandem.client import Client, Run
from tandem.episodes import Episode, EpisodeState, Turn
from tandem.handles import TrainHandle
from tandem.jobs import TrainJob, TrainResult
from tandem.runs import LoraConfig, LossConfig, OptimizerConfig, RunSpec
from tandem.trajectories import Completion, Origin, Trajectory, TrajectoryGroup

__all__ = [
    "Client", "Completion", "Episode", "EpisodeState", "LoraConfig", "LossConfig", "OptimizerConfig", "Origin",
    "Run", "RunSpec", "TrainHandle", "TrainJob", "TrainResult", "Trajectory", "TrajectoryGroup", "Turn",
]
__version__ = "0.1.0"
