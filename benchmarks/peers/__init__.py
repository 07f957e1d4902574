"""Peer libraries run in environments of their own (see ``nt.py`` and ``make_venv.sh``)."""
