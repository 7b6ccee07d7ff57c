#!/bin/bash
cd /testbed && python3 -c "import calc; assert calc.add(1,2)==3"
