#!/bin/sh
# Host discovery for the elastic tests: prints "host:slots" lines for horovodrun.
# $KB_ELASTIC_HOSTS names a file with those lines (a test rewrites it to add or remove
# slots); without it, two one-slot "hosts" that are both this machine: Horovod blacklists
# the host of a worker that fails, so a single "localhost:2" would end the whole job when
# one worker dies.
if [ -n "$KB_ELASTIC_HOSTS" ] && [ -f "$KB_ELASTIC_HOSTS" ]; then
    cat "$KB_ELASTIC_HOSTS"
else
    printf 'localhost:1\n127.0.0.1:1\n'
fi
