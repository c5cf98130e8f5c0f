"""`/metrics` says which compute path the server runs: `pagedllm:kernel_info`, an info metric
with the active C kernels, the ones on the torch path, and the CPU features."""

from __future__ import annotations

import pytest

from tests.server.helpers import MODEL, read_metrics

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def test_metrics_export_the_kernel_set(http, server):
    from pagedllm.kernels.status import kernel_status

    (labels,) = [dict(k[1]) for k in read_metrics(http) if k[0] == "pagedllm:kernel_info"]
    assert labels["model_name"] == MODEL
    assert labels["path"] in ("c", "torch", "mixed")
    expected = kernel_status()  # this process sees the same machine, compiler and cache
    assert labels["kernels"] == ",".join(expected.active_names)
    assert labels["cpu_features"] == ",".join(expected.cpu_features)
    assert ("C kernels" in server.log_tail(200_000)), "start-up must log which kernels run"
