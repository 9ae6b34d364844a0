import re,glob,collections,statistics as st
rows=collections.OrderedDict()
names={'amqp':'RabbitMQ','amqp10':'AMQP 1.0 (RabbitMQ)','nats':'NATS JetStream','kafka':'Kafka (tansu)','redis':'Redis Streams'}
for f in sorted(glob.glob('*-*-*.txt')):
    b,side,r=f[:-4].split('-')
    t=open(f).read()
    if b in('amqp','nats','redis'):
        for l in t.splitlines():
            if l.startswith('| ') and not l.startswith('| mode') and not l.startswith('| ---'):
                c=[x.strip() for x in l.strip('|').split('|')]
                rows.setdefault((b,c[0]),{'before':[],'after':[]})[side].append((int(c[1]),float(c[2])))
    elif b=='kafka':
        for l in t.splitlines():
            m=re.match(r'(.+?)\s+(\d+) msg/s\s+([\d.]+)×',l)
            if m: rows.setdefault((b,m.group(1).strip()),{'before':[],'after':[]})[side].append((int(m.group(2)),float(m.group(3))))
    else:
        rs=[]
        for l in t.splitlines():
            m=re.match(r'(.+?)\s+(\d+) msgs/s',l)
            if m: rs.append((m.group(1).strip(),int(m.group(2))))
        base=(rs[0][1]+rs[-1][1])/2
        for i,(k,v) in enumerate(rs):
            if i==len(rs)-1: k=k+' (again)'
            rows.setdefault((b,k),{'before':[],'after':[]})[side].append((v,v/base))
print("| broker | mode | before msgs/s (3 runs) | ratio | after msgs/s (3 runs) | ratio | after ÷ before (medians) |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
for (b,m),d in rows.items():
    bf=d['before']; af=d['after']
    rng=lambda L: f"{min(x[0] for x in L):,}–{max(x[0] for x in L):,}"
    med=lambda L,i: st.median(x[i] for x in L)
    print(f"| {names[b]} | {m} | {rng(bf)} | {med(bf,1):.2f} | {rng(af)} | {med(af,1):.2f} | {med(af,0)/med(bf,0):.2f} |")
