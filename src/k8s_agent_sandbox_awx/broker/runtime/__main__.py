"""``python -m k8s_agent_sandbox_awx.broker.runtime``: one sandbox runtime, or the fork server."""

import sys

from ._main import main

sys.exit(main())
