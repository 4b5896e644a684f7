from __future__ import annotations

import pytest

from tools.local_server import running_server


@pytest.fixture(scope="session")
def server(smollm2_dir, tmp_path_factory):
    """The default model behind the full ensemble, served by a real tritonserver."""
    with running_server(smollm2_dir, tmp_path_factory.mktemp("smollm2_server")) as handle:
        yield handle
