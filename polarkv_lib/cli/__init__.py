"""Terminal commands beside the service itself: `polarkv admin ...` (admin.py)."""
