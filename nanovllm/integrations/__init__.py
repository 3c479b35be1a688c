"""Bridges to other systems (Ray Data); each is imported only when used, with its own extra."""
