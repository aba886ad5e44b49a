"""The demo model shipped with loraplex (made by scripts/demo/), and the `loraplex demo` terminal UI."""
