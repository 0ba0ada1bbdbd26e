#!/usr/bin/env bash
# One GPU call: test_cuda.py selections with cudapool (native results are
# in docs/pytorch-tests) and test_cudagraph_trees part 2 in both modes.
# Carry lib, .ref and .whl; results in $OUT/pt.tgz and a summary.
set -u
pip install -q --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site CUDAPOOL_LIBRARY=$PWD/lib/libcudapool.so CUDAPOOL_CACHE=/tmp/cpcache PYTHONUNBUFFERED=1
R=/tmp/pt; mkdir -p $R; T=.ref/pytorch-tests; S=gpu/pytorch_tests/selections
cat $S/test_cuda.memory.txt $S/test_cuda.streams.txt > /tmp/ms.txt
timeout 120 gpu/pytorch_tests/run.sh -m cudapool -t 100 -s $S/test_cuda.graphs.txt -n cuda-graphs $T/test_cuda.py $R >/dev/null 2>&1
timeout 200 gpu/pytorch_tests/run.sh -m cudapool -t 180 -s /tmp/ms.txt -n cuda-ms $T/test_cuda.py $R >/dev/null 2>&1
timeout 320 gpu/pytorch_tests/run.sh -t 150 -s $S/test_cudagraph_trees.part2.txt -n trees-part2 $T/inductor/test_cudagraph_trees.py $R >/dev/null 2>&1
tar czf $OUT/pt.tgz -C $R .
cat $R/*.run
grep -h -o 'testcase [^>]*name="test_graph_capture_reclaim[^"]*"[^>]*>\(<[a-z]*\)\?' $R/cuda-graphs.cudapool.xml $R/cuda-ms.cudapool.xml | head
python3 - <<'PY'
import glob, xml.etree.ElementTree as ET
for f in sorted(glob.glob('/tmp/pt/*.xml')):
    r = ET.parse(f).getroot()
    c = {'pass':0,'fail':0,'skip':0}
    bad = []
    for tc in r.iter('testcase'):
        k = 'pass'
        for ch in tc:
            if ch.tag in ('failure','error'): k='fail'
            elif ch.tag == 'skipped': k='skip'
        c[k]+=1
        if k=='fail': bad.append(tc.get('name'))
    print(f.split('/')[-1], c, ' '.join(bad)[:600])
PY
