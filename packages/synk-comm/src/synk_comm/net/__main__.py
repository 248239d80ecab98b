"""``python -m synk_comm.net ADDRESS NODE NPROC``: a bare node agent (:func:`synk_comm.net.agent.main`)."""

from synk_comm.net.agent import main

raise SystemExit(main())
