#!/usr/bin/env bash
# Makes gpu-controller's TLS material for the kustomize manifests (the Helm
# chart makes its own): a CA, and a serving certificate signed by it for the
# names agents dial (gpu-controller.NAMESPACE.svc and its cluster.local
# form). Writes ca.crt, tls.crt and tls.key into OUTDIR (ca.key too: keep it
# to sign a renewal, or delete it), then prints the command that makes the
# Secret gpu-controller-tls from them.
#
#   packaging/kustomize/controller-tls.sh [NAMESPACE] [OUTDIR] [DAYS]
#
# Defaults: gpu-agent, ./gpu-controller-tls, 3650. Needs openssl.
set -euo pipefail
ns=${1:-gpu-agent}
out=${2:-./gpu-controller-tls}
days=${3:-3650}
service=gpu-controller

command -v openssl >/dev/null || { echo "error: openssl is needed (apt-get install openssl)" >&2; exit 1; }
case "$ns" in
  "" | *[!a-z0-9-]*) echo "error: $ns: not a namespace name" >&2; exit 1 ;;
esac
mkdir -p "$out"
umask 077
host="$service.$ns.svc"
openssl req -x509 -newkey rsa:2048 -nodes -days "$days" \
  -subj "/CN=gpu-controller CA" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$host" \
  -keyout "$out/tls.key" -out "$out/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:%s.cluster.local\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n' \
  "$host" "$host" >"$out/tls.ext"
openssl x509 -req -in "$out/tls.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -days "$days" -extfile "$out/tls.ext" -out "$out/tls.crt" 2>/dev/null
rm -f "$out/tls.csr" "$out/tls.ext" "$out/ca.srl"
openssl verify -CAfile "$out/ca.crt" "$out/tls.crt" >/dev/null
cat <<EOF
Wrote $out/ca.crt, $out/tls.crt (for $host) and $out/tls.key.
Make the Secret before applying the manifests:

  kubectl create namespace $ns --dry-run=client -o yaml | kubectl apply -f -
  kubectl -n $ns create secret generic gpu-controller-tls --type=kubernetes.io/tls \\
    --from-file=tls.crt=$out/tls.crt --from-file=tls.key=$out/tls.key --from-file=ca.crt=$out/ca.crt
EOF
