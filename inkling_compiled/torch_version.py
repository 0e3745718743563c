"""The installed torch release, read once: the code and tests that work around one release's behaviour ask here."""

import torch
from torch.torch_version import TorchVersion

TORCH_VERSION = TorchVersion(torch.__version__)
BEFORE_2_13 = TORCH_VERSION < (2, 13)  # torch 2.11: the GPU machine's release
