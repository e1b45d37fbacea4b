"""The base layer: where tensors live and how runs are seeded. Every other layer may import it; it imports only
torch (and the standard library)."""
