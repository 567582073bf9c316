"""A process and its host: which ports processes listen on, host identity for shared
memory, and a ready process's startup objects kept out of the garbage collector's way.
"""
