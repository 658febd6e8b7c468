# Stand-in for RoboTwin's envs package (see tests/robotwin_standin/README.md).
from ._GLOBAL_CONFIGS import CONFIGS_PATH, ROOT_PATH

__all__ = ["CONFIGS_PATH", "ROOT_PATH"]
