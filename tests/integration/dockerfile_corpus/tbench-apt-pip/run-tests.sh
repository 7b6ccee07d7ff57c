#!/bin/bash
python3 -m pytest /tests
