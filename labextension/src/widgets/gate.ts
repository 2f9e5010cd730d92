/**
 * The adapter gate's table in `%overmind adapters` (overmind_jupyter/widgets/gate.py `GateView`): its
 * mode and default, and per adapter its routing, requests in flight and queued, and the longest wait.
 * The `gate` trait is `gate_view(gate.state())` (gate.py).
 */

import { Child, h } from '../dom';
import type { IModel, IRenderProps, IWidgetModule } from './anywidget';
import { live } from './live';
import './gate.css';

interface IAdapterRow {
  name: string;
  routing: string;
  in_flight: number;
  queued: number;
  wait: string;
  default: boolean;
  active: boolean;
}

interface IGate {
  mode?: string;
  kind?: string;
  default?: string;
  exclusive?: boolean;
  switches?: number;
  blockers?: Record<string, string>;
  engine?: { batches: number; rows: number; mean_batch_rows: number; largest_batch_rows: number } | null;
  adapters?: IAdapterRow[];
}

const RUNS_TITLE =
  "routed: its requests run at the same time as other adapters' (the gate routes each row's adapter); " +
  "switched: PEFT must set it for the whole model, so other adapters' requests wait";
const WAIT_TITLE =
  'while requests wait: how long the oldest has waited; else the longest any request of this adapter ' +
  'waited to be admitted so far';

function row(r: IAdapterRow): HTMLElement {
  return h(
    'tr',
    {
      'data-testid': 'overmind-widget-adapter',
      'data-adapter': r.name,
      class: `${r.default ? 'om-default ' : ''}${r.active ? 'om-active' : ''}`.trim() || undefined
    },
    h('td', {}, r.name, r.default ? h('span', { class: 'om-muted' }, ' (default)') : null),
    h('td', {}, r.routing),
    h('td', { class: 'om-num', 'data-testid': 'overmind-widget-in-flight' }, String(r.in_flight)),
    h('td', { class: 'om-num', 'data-testid': 'overmind-widget-queued' }, String(r.queued)),
    h('td', { class: 'om-num', 'data-testid': 'overmind-widget-wait' }, r.wait)
  );
}

function draw(model: IModel, root: HTMLElement): void {
  const g: IGate = model.get('gate') || {};
  const switches = g.switches ?? 0;
  const parts: Child[] = [
    h(
      'div',
      { class: 'om-head' },
      h('span', { class: 'om-title' }, model.get('title') || 'Adapter gate'),
      h('span', { class: `om-mode om-mode-${g.mode || 'none'}`, 'data-testid': 'overmind-widget-mode' }, g.mode || '?'),
      g.kind ? h('span', { class: 'om-muted' }, g.kind) : null,
      h('span', {}, 'default ', h('b', { 'data-testid': 'overmind-widget-default' }, g.default || '?')),
      h('span', { class: 'om-muted' }, `${switches} ${switches === 1 ? 'switch' : 'switches'}`),
      g.exclusive ? h('span', { class: 'om-sim' }, 'exclusive change running') : null
    )
  ];
  if (model.get('error')) {
    parts.push(h('div', { class: 'om-error' }, model.get('error')));
  }
  parts.push(
    h(
      'table',
      { 'data-testid': 'overmind-widget-adapters' },
      h(
        'thead',
        {},
        h(
          'tr',
          {},
          h('th', {}, 'Adapter'),
          h('th', { title: RUNS_TITLE }, 'Runs'),
          h('th', { class: 'om-num', title: 'requests running now' }, 'In flight'),
          h('th', { class: 'om-num', title: 'requests waiting to be admitted or batched' }, 'Queued'),
          h('th', { class: 'om-num', title: WAIT_TITLE }, 'Longest wait')
        )
      ),
      h('tbody', {}, ...(g.adapters ?? []).map(row))
    )
  );
  const blockers = Object.entries(g.blockers ?? {});
  if (blockers.length) {
    parts.push(
      h(
        'div',
        { class: 'om-muted' },
        'switched, not routed: ',
        blockers.map(([k, v]) => (k === '*' ? '' : `${k}: `) + v).join('; ')
      )
    );
  }
  if (g.engine) {
    const e = g.engine;
    parts.push(
      h(
        'div',
        { class: 'om-muted' },
        `batching engine: ${e.batches} batch${e.batches === 1 ? '' : 'es'}, ${e.rows} row${e.rows === 1 ? '' : 's'}, ${e.mean_batch_rows} rows per batch, ` +
          `largest ${e.largest_batch_rows}`
      )
    );
  }
  if (model.get('notice')) {
    parts.push(h('div', { class: 'om-notice', 'data-testid': 'overmind-widget-notice' }, model.get('notice')));
  }
  root.replaceChildren(...(parts.filter(Boolean) as Node[]));
}

const widget: IWidgetModule = {
  render({ model, el }: IRenderProps) {
    const root = h('div', { class: 'om-w om-gate', 'data-testid': 'overmind-widget-gate' });
    el.append(root);
    return live(model, el, ['gate', 'title', 'error', 'notice'], () => draw(model, root));
  }
};

export default widget;
