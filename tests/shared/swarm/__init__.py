"""Tests of the SWARM pipeline mode's pure cores (shared.swarm)."""
