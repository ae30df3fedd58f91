"""Engine tests run torch on one thread: on a shared 2-core machine, intra-op threads that wait on
each other at every tiny op make small-model steps up to 100× slower when the other core is busy."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
