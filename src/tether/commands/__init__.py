"""``tether`` commands kept outside ``cli.py`` (which holds the app and is at its line limit); ``cli.py``
registers each on its app. Like ``cli.py`` they only parse arguments and call the public API."""
