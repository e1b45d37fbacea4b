"""Shipped ``steadyrl train`` configs (YAML); ``steadyrl train NAME`` runs ``NAME.yaml`` from here."""
