/**
 * The GPU units bar of `%overmind units` and `%overmind status` (overmind_jupyter/widgets/devices.py
 * `UnitsBar`): a bar per device, a segment per holder (busy solid, idle hatched, this kernel's outlined),
 * and the panel's chart of units over time, from the samples this view saw.
 *
 * It draws the side panel's state (`state`: api.ts `IPanelState`, of which it reads `units` and `texts`)
 * and `local`: this kernel's pid, and the ledger's settings the panel's state leaves out.
 */

import type { IDevice, IUnitHolder } from '../api';
import { unitsChart } from '../charts';
import { Child, h, nameOf } from '../dom';
import type { IUnitSample } from '../model';
import type { IModel, IRenderProps, IWidgetModule } from './anywidget';
import { live, stateOf } from './live';
import './units.css';

/** Samples of units in use kept for the chart, as the panel keeps (model.ts). */
const UNIT_SAMPLES = 150;

/** What only the kernel knows: the `local` trait (widgets/devices.py `local_facts`). */
interface ILocal {
  /** This kernel's pid: its holdings say "(this kernel)". */
  pid?: number;
  /** OVERMIND_FAKE_GPUS of the daemon's ledger ('' with real devices). */
  fake_gpus?: string;
  /** GiB of each device the ledger keeps out of its units. */
  reserve_gib?: number;
}

function mine(holder: IUnitHolder, local: ILocal): boolean {
  return holder.pid !== null && holder.pid === local.pid;
}

function holderTitle(x: IUnitHolder, local: ILocal): string {
  const who = mine(x, local) ? `this kernel (${nameOf({ ...x, label: x.kernel, pid: x.pid ?? 0 })})` : nameOf({ ...x, label: x.kernel, pid: x.pid ?? 0 });
  const units = x.units ?? 0;
  return `${x.label || 'a model'}: ${units} ${units === 1 ? 'unit' : 'units'}, ${who}, ${x.busy ? 'busy' : 'idle'}`;
}

function deviceBlock(d: IDevice, local: ILocal): HTMLElement {
  const segments: Child[] = d.holders.map(x => {
    const segment = h(
      'div',
      {
        class: `om-seg ${x.busy ? 'om-busy' : 'om-idle'}${mine(x, local) ? ' om-mine' : ''}`,
        'data-testid': 'overmind-widget-segment',
        'data-busy': x.busy ? 'true' : 'false',
        'data-model': x.label,
        title: holderTitle(x, local)
      },
      h('span', { class: 'om-seg-label' }, `${x.label || 'a model'} (${x.units ?? '?'})`)
    );
    segment.style.flex = `${x.units ?? 1} 1 0`;
    return segment;
  });
  if (d.free > 0) {
    const free = h('div', { class: 'om-seg om-free', title: `${d.free} units free` });
    free.style.flex = `${d.free} 1 0`;
    segments.push(free);
  }
  const rows = d.holders.map(x =>
    h(
      'tr',
      { 'data-testid': 'overmind-widget-holder' },
      h('td', {}, h('span', { class: `om-swatch ${x.busy ? 'om-busy' : 'om-idle'}` }), ' ', x.label || 'a model'),
      h('td', { class: 'om-num' }, String(x.units ?? '?')),
      h(
        'td',
        { title: x.detail, 'data-testid': 'overmind-widget-holder-kernel' },
        nameOf({ ...x, label: x.kernel, pid: x.pid ?? 0 }),
        mine(x, local) ? h('b', {}, ' (this kernel)') : null
      ),
      h('td', {}, x.busy ? h('b', {}, 'busy') : x.busy === null ? '' : 'idle')
    )
  );
  return h(
    'div',
    { class: 'om-device', 'data-testid': 'overmind-widget-device', 'data-device': d.device },
    h(
      'div',
      { class: 'om-head' },
      h('span', { class: 'om-title' }, d.device),
      d.simulated
        ? h('span', { class: 'om-sim', 'data-testid': 'overmind-widget-simulated' }, 'simulated')
        : h('span', { class: 'om-muted' }, d.model),
      h('span', {}, `${d.used} of ${d.total} units used, ${d.free} free`)
    ),
    h('div', { class: 'om-bar' }, ...segments),
    rows.length
      ? h('table', { class: 'om-holders' }, h('tbody', {}, ...rows))
      : h('div', { class: 'om-muted' }, 'no holders')
  );
}

function draw(model: IModel, root: HTMLElement, samples: IUnitSample[]): void {
  const state = stateOf(model);
  const local: ILocal = model.get('local') || {};
  const error: string = model.get('error');
  const units = state?.units ?? null;
  const devices = units?.devices ?? [];
  const reserve = local.reserve_gib ? `, ${local.reserve_gib} GiB of each device reserved` : '';
  const parts: Child[] = [
    h(
      'div',
      { class: 'om-head' },
      h('span', { class: 'om-title' }, 'GPU units'),
      h('span', { class: 'om-muted' }, `1 unit = ${state?.texts.unit_bytes || '1 GiB'}${reserve}`),
      units?.simulated &&
        h(
          'span',
          { class: 'om-sim' },
          `simulated devices${local.fake_gpus ? ` (OVERMIND_FAKE_GPUS=${local.fake_gpus})` : ''}`
        ),
      h(
        'span',
        { class: 'om-legend' },
        h('span', { class: 'om-swatch om-busy' }),
        ' busy ',
        h('span', { class: 'om-swatch om-idle' }),
        ' idle'
      )
    )
  ];
  if (error) {
    parts.push(h('div', { class: 'om-error', 'data-testid': 'overmind-widget-units-error' }, error));
  }
  if (units?.error) {
    parts.push(h('div', { class: 'om-error' }, `ledger disabled: ${units.error}`));
  }
  if (!devices.length && !error) {
    parts.push(
      h(
        'div',
        { class: 'om-muted', 'data-testid': 'overmind-widget-nodevices' },
        'no GPU known yet (a kernel reports its devices when it first uses units)'
      )
    );
  }
  parts.push(...devices.map(d => deviceBlock(d, local)));
  if (units && units.waiting > 0) {
    parts.push(
      h(
        'div',
        { 'data-testid': 'overmind-widget-waiter' },
        `${units.waiting} ${units.waiting === 1 ? 'request' : 'requests'} waiting for units`
      )
    );
  }
  if (state && devices.length) {
    const used: Record<string, number> = {};
    devices.forEach(d => (used[d.device] = d.used));
    samples.push({ t: Date.now() / 1000, used });
    samples.splice(0, Math.max(0, samples.length - UNIT_SAMPLES));
    parts.push(unitsChart(state, samples));
  }
  root.replaceChildren(...(parts.filter(Boolean) as Node[]));
}

const widget: IWidgetModule = {
  render({ model, el }: IRenderProps) {
    const root = h('div', { class: 'om-w om-units', 'data-testid': 'overmind-widget-units' });
    const samples: IUnitSample[] = []; // this view's, from its first draw
    el.append(root);
    return live(model, el, ['state', 'local', 'error'], () => draw(model, root, samples));
  }
};

export default widget;
