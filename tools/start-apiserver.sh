#!/usr/bin/env bash
# Start etcd and a kube-apiserver on 127.0.0.1 to try remote mode by hand. The binaries come from
# tools/build-kube-apiserver.sh (1.20.2) or tools/build-kube-apiserver-current.sh; the tests start
# their own control plane (tests/k8s_support).
#
# Usage: tools/start-apiserver.sh [RUN_DIR]     (default /tmp/kapi; it must not exist or be empty)
#   K8S_BIN    directory of etcd and kube-apiserver (default /var/tmp/nodeplan-k8s/bin, 1.20.2; the
#              current release: /var/tmp/nodeplan-k8s-<version>/bin, tools/build-kube-apiserver-current.sh)
#   ETCD_PORT  etcd's client port; its peer port is the next one (default 23790)
#   API_PORT   the apiserver's HTTPS port (default 16443)
# Writes RUN_DIR/kubeconfig: the apiserver's own CA embedded, a random admin bearer token.
# Stop: kill "$(cat RUN_DIR/apiserver.pid)" "$(cat RUN_DIR/etcd.pid)"
set -euo pipefail
RUN=$(realpath -m "${1:-/tmp/kapi}")
BIN=$(realpath -m "${K8S_BIN:-/var/tmp/nodeplan-k8s/bin}")
ETCD_PORT=${ETCD_PORT:-23790}
API_PORT=${API_PORT:-16443}

for b in etcd kube-apiserver; do
  [ -x "$BIN/$b" ] || { echo "no $BIN/$b: run tools/build-kube-apiserver.sh first" >&2; exit 1; }
done
mkdir -p "$RUN"
if [ -n "$(ls -A "$RUN")" ]; then
  echo "$RUN is not empty: stop what runs from it and remove it, or name another directory" >&2
  exit 1
fi
cd "$RUN"
mkdir certs etcd
umask 077
TOKEN=$(openssl rand -hex 16)
printf '%s,admin,admin,system:masters\n' "$TOKEN" >tokens.csv
openssl genrsa -out sa.key 2048 2>/dev/null
openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null

peer="http://127.0.0.1:$((ETCD_PORT + 1))"
"$BIN/etcd" --name=default --data-dir="$RUN/etcd" \
  --listen-client-urls="http://127.0.0.1:$ETCD_PORT" --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls="$peer" --initial-advertise-peer-urls="$peer" --initial-cluster="default=$peer" \
  >etcd.log 2>&1 &
echo $! >etcd.pid

# kube-apiserver 1.20 requires the service-account issuer and keys; the token file gives the
# admin its rights under RBAC. Later releases refuse the loopback advertise address as the
# `kubernetes` Service's endpoint, so they reconcile none.
reconciler=()
case "$("$BIN/kube-apiserver" --version)" in
  "Kubernetes v1.20."*) ;;
  *) reconciler=(--endpoint-reconciler-type=none) ;;
esac
"$BIN/kube-apiserver" "${reconciler[@]}" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" \
  --cert-dir="$RUN/certs" --token-auth-file="$RUN/tokens.csv" --authorization-mode=RBAC \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file="$RUN/sa.pub" \
  --service-account-signing-key-file="$RUN/sa.key" --service-cluster-ip-range=10.0.0.0/24 \
  --disable-admission-plugins=ServiceAccount \
  >apiserver.log 2>&1 &
echo $! >apiserver.pid

ready=
for _ in $(seq 240); do
  if curl -fsk -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$API_PORT/readyz" >/dev/null 2>&1; then
    ready=1
    break
  fi
  kill -0 "$(cat apiserver.pid)" 2>/dev/null || break
  sleep 0.5
done
if [ -z "$ready" ]; then
  echo "kube-apiserver did not become ready; the end of $RUN/apiserver.log:" >&2
  tail -20 apiserver.log >&2
  kill "$(cat apiserver.pid)" "$(cat etcd.pid)" 2>/dev/null || true
  exit 1
fi

# The self-signed serving certificate file holds the leaf, then the CA that signed it.
ca=$(awk '/-----BEGIN CERTIFICATE-----/ { n++ } n == 2' certs/apiserver.crt | base64 -w0)
cat >kubeconfig <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority-data: $ca
users:
- name: admin
  user:
    token: $TOKEN
contexts:
- name: local
  context: {cluster: local, user: admin, namespace: default}
current-context: local
EOF
echo "ready: export KUBECONFIG=$RUN/kubeconfig"
