"""A write on a read-only file system (a pod's read-only root without an emptyDir there) is
the caller's to fix, not a fault of the runtime: 403 ``permission_denied`` naming the read-only
file system and the emptyDir, on the file API and the legacy upload alike (it was a 500
``io_error``; issue 28, 7b). The real container's check: tests/kube/test_images.py."""

from __future__ import annotations

import errno
from pathlib import Path

from k8s_agent_sandbox_awx.broker.runtime import _legacy, _paths


def test_the_file_api_refuses_a_read_only_file_system_with_403(tmp_path: Path) -> None:
    roots = _paths.Roots.of(str(tmp_path))
    target = _paths.SandboxPath("/app/a.txt", "/app", roots, ("a.txt",))
    refused = _paths.refusal(OSError(errno.EROFS, "Read-only file system"), target)
    assert (refused.status, refused.code) == (403, "permission_denied")
    assert "read-only file system" in refused.detail and "emptyDir" in refused.detail
    assert "/app/a.txt" in refused.detail


def test_the_legacy_upload_refuses_a_read_only_file_system_with_403() -> None:
    refused = _legacy._upload_failure(OSError(errno.EROFS, "Read-only file system"))
    assert refused.status == 403 and "read-only file system" in refused.detail
    still = _legacy._upload_failure(OSError(errno.EIO, "I/O error"))
    assert still.status == 400  # what it was for other errors
